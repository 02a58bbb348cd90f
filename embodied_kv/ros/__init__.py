"""ROS 2 edge: rclpy lifecycle nodes and the in-process container.

The only layer that imports rclpy or message types (DESIGN §2); it converts
messages and calls the engine, and holds no model logic.
"""
