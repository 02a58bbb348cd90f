"""Behavioural evaluation (no ROS): the model acting and answering through the engine."""
