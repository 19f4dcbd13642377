"""Shared API types: the RLTrainingJob spec (the CRD is generated from it), the step-report
protocol between trainer and operator, and helpers to load manifests with clear errors."""
