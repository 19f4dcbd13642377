"""rlpacer.sim"""
