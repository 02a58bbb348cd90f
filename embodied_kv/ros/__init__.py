"""ROS 2 edge: rclpy lifecycle nodes and the in-process container.

The only layer that imports rclpy or message types (docs/ARCHITECTURE.md, layers); it converts
messages and calls the engine, and holds no model logic.
"""
