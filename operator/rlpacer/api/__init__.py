"""rlpacer.api"""
