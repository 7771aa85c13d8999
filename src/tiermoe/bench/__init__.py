"""tiermoe.bench"""
