"""tiermoe.store"""
