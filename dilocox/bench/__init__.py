"""dilocox.bench"""
