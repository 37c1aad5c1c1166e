"""eyas.inference"""
