"""tiermoe.scheduler"""
