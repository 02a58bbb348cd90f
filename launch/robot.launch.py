"""`ros2 launch embodied_kv robot.launch.py [config:=PATH] [preset:=NAME]`.

Starts the robot process (all five lifecycle nodes in one process, one engine).
The node keeps its own names: no `name=` here, since a node-name remap would
rename every node of the process.
"""

from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument
from launch.substitutions import LaunchConfiguration, PathJoinSubstitution
from launch_ros.actions import Node
from launch_ros.substitutions import FindPackageShare


def generate_launch_description() -> LaunchDescription:
    config = DeclareLaunchArgument(
        "config",
        default_value=PathJoinSubstitution(
            [FindPackageShare("embodied_kv"), "config", "robot.yaml"]
        ),
        description="ROS 2 parameter file shared by every node",
    )
    preset = DeclareLaunchArgument(
        "preset",
        default_value="",
        description="model preset (world | tiny | pi05); empty = the config file's",
    )
    robot = Node(
        package="embodied_kv",
        executable="robot",
        output="screen",
        emulate_tty=True,
        arguments=[
            "--config",
            LaunchConfiguration("config"),
            "--preset",
            LaunchConfiguration("preset"),
        ],
    )
    return LaunchDescription([config, preset, robot])
