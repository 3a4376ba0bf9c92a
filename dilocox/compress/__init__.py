"""dilocox.compress"""
