"""megaloom.comm"""
