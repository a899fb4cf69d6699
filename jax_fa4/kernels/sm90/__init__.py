"""Hopper (sm_90a) attention kernels: forward (flash_fwd.py, keyed by fwd_config.FwdConfig)."""
