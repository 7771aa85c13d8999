"""tiermoe.models"""
