"""The control-plane REST API (``/api/v1``): policies, records, statistics."""
