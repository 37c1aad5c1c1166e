"""eyas.data"""
