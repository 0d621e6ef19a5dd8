"""Provider adapters (AWS, GCP, on-prem NVML) — arrive with the provider-adapters issue.

The planner and simulator (``broker``) do not depend on this package yet.
"""
