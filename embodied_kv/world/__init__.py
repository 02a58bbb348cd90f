"""The synthetic tabletop world (numpy only): scenes, rendering, tasks, a scripted expert,
questions, memory facts and narrations. Used by training, `eval world` and (later) the demo."""
