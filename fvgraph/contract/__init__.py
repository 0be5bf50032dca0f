"""The step contract, at the bottom of fvgraph: what every layer above shares and nothing here imports.

A loop's WorkPlan / Done (plan.py) and the StepKind declarations with their typed inputs and outputs
(step_kind.py), the Loop and LoopState protocols and saved states (loop.py, saved_state.py), what the
weights say (model_facts.py), the runtime's counters (counters.py), the region markers a step body
puts in its graph for the passes (markers.py), and the denoiser sections a step-caching method runs
on (denoiser_sections.py).
"""
