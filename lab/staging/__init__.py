"""staging"""
