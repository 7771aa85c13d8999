"""tiermoe.moe"""
