"""What the files that users hand to the store's flags look like, in words, for the help texts.

Several commands read routing statistics (`serve`/`generate --expert-stats`, `plan --stats`,
`sim --stats`); their help repeats one description, kept here so that it matches the loader
(planner.load_stats). This module imports nothing: the CLI parser reads it.
"""

STATS_FORMAT = ("a routing trace (.npz) written by `tiermoe serve --record-routing FILE` (its decode tokens' "
                "picks are counted), or a flat JSON object mapping each MoE layer to its pick counts indexed by "
                "expert id, under a key that holds \"layers.<L>\" (L: the layer number), e.g. "
                "{\"layers.1\": [120, 4, 0, 37], \"layers.2\": [...]}")
