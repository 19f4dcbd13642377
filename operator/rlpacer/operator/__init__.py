"""rlpacer.operator"""
