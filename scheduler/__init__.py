"""Scheduler: hardware profiles, cost model, ordering policies, discrete-event simulator, trace replay."""
from megaloom.scheduler.cost import CostModel, OpCoeffs
from megaloom.scheduler.policies import (
    POLICIES, CriticalPathPolicy, ExpertInterleavePolicy, PriorityPolicy, RotatedPolicy, StaticPolicy, make_policy,
)
from megaloom.scheduler.profile import HardwareProfile, list_profiles, load_profile
from megaloom.scheduler.simulator import Schedule, Simulator, parse_units
from megaloom.scheduler.world import simulate_world

__all__ = [
    "POLICIES", "CostModel", "CriticalPathPolicy", "ExpertInterleavePolicy", "HardwareProfile", "OpCoeffs",
    "PriorityPolicy", "RotatedPolicy", "Schedule", "Simulator", "StaticPolicy", "list_profiles", "load_profile",
    "make_policy", "parse_units", "simulate_world",
]
