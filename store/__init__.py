"""The store: request records and step statistics in a database (SQLite or
PostgreSQL), written off the serving path by the recorder, and Prometheus
metrics.  Sits between ``engine/`` (which it reads records from) and
``tuner/`` (which reads it)."""
