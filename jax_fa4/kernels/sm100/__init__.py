"""Blackwell (sm_100a) kernels. Config modules import without the compiler."""
