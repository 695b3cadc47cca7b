"""What the running server exports about itself: metric names, Ray metrics, the /metrics text.

Low in the house so the placement, replica and API floors can all count into it; the tools that
read these names (dashboards, alert rules in `deployments/ops/`) sit on top (docs/architecture.md).
"""
