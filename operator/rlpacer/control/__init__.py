"""rlpacer.control"""
