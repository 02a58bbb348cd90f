"""`pip install .` of the Python package alone, for a GPU machine without ROS 2.

The ROS 2 build is CMakeLists.txt (ament_cmake: interfaces + this package);
colcon reads package.xml and does not use this file.
"""

from glob import glob

from setuptools import find_packages, setup

PACKAGE = "embodied_kv"

setup(
    name=PACKAGE,
    version="0.1.0",
    description="A pi0.5-class VLA on one GPU behind one KV cache manager, as ROS 2 nodes",
    license="Apache-2.0",
    maintainer="embodied_kv maintainers",
    maintainer_email="maintainers@embodied-kv.dev",
    python_requires=">=3.11",
    packages=find_packages(include=[PACKAGE, f"{PACKAGE}.*"]),
    # the trained `world` model the embedded default loads (engine/loading.py SHIPPED)
    package_data={PACKAGE: [f"data/{d}/{f}" for d in ("world", "world_smooth")
                            for f in ("weights.safetensors", "tokenizer.json")]},
    # ament layout, as ament_python packages install it.
    data_files=[
        ("share/ament_index/resource_index/packages", [f"resource/{PACKAGE}"]),
        (f"share/{PACKAGE}", ["package.xml"]),
        (f"share/{PACKAGE}/launch", glob("launch/*.launch.py")),
        (f"share/{PACKAGE}/config", glob("config/*.yaml")),
    ],
    install_requires=[
        "numpy>=2",
        "safetensors>=0.4",
        "tokenizers>=0.20",  # FAST action tokens (model/fast_tokenizer.py), the world's words
        "torch>=2.13",
        "tqdm>=4",  # `embodied-kv train` progress
        "transformers>=5",
    ],
    extras_require={
        # rclpy and the message wheels; embodied_kv.msg/.srv also need the cmake build.
        "ros": [
            "pillow",  # sensor_msgs/CompressedImage (jpeg / png) in ros/image.py
            "PyYAML",
            "ros-rclpy",
            "ros-rmw-fastrtps-cpp",
            "ros-std-msgs",
            "ros-sensor-msgs",
            "ros-std-srvs",
            "ros-lifecycle-msgs",
            "ros-trajectory-msgs",
            "ros-diagnostic-msgs",
        ],
        # `embodied-kv serve` (serve/); its tests also need openpi-client, installed with
        # --no-deps (requirements-nodeps.lock: it pins numpy<2)
        "serve": ["websockets>=13", "msgpack>=1.0", "PyYAML"],
        "test": ["pytest", "pytest-timeout", "ruff"],
    },
    entry_points={
        "console_scripts": [
            "embodied-kv = embodied_kv.cli:main",
            "robot = embodied_kv.ros.container:main",
        ],
    },
)
