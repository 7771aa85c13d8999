"""tiermoe.runner"""
