"""megaloom.scheduler"""
