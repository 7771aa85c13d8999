"""tiermoe.server"""
