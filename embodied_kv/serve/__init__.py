"""`embodied-kv serve`: openpi's websocket policy protocol over the robot's engine.

Any `openpi-client` `WebsocketClientPolicy` drives it unchanged (docs/serve.md). No
rclpy here: this is the second edge beside ros/, reading the same config file
(config_file.py) into the same EngineConfig (engine/params.py).

    wire.py     msgpack frames with numpy arrays, as openpi_client.msgpack_numpy packs them
    layouts.py  LIBERO / DROID / ALOHA observation dicts -> the engine's Observation
    session.py  one connection's session: its frame (noise seed) and its capsule names
    policy.py   the engine verbs a frame asks for: infer, reset, snapshot, restore
    server.py   the asyncio websocket server; engine work on one thread, off the loop
    config.py   ServeConfig and the engine's config for serving, from the YAML
    main.py     the command line
    process.py  `embodied-kv serve` as a child process (tests, scripts)
"""
