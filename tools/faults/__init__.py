"""The fault campaigns of ``tools/fault_campaign.py``, one module each."""
