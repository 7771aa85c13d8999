"""tiermoe.eval"""
