"""megaloom.graphs"""
