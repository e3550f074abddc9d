"""Predicted against measured tok/s: each case predicted from its nodes' profiles, then run.

``zctl bench plan`` (``python -m tools.plan``): each case's local cluster is started with
its nodes profiling themselves as they join; once every profile and link is measured, the
prediction is read from the coordinator's status (the planner's model of time on the
running placement, controlplane/planner/running.py), then one stream and eight run on it
and the prediction's error is reported against targets.

``cases`` holds the case table and which of them run here, ``throttle`` the CPU quota a
slowed node runs under, ``measure`` a case's cluster and runs, ``report`` the errors, the
targets, the JSON and the table, ``cli`` the command line.
"""
