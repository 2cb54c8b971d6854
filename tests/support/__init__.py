"""What the tests share: models, data, paths and worker scripts.

`helpers` (small models, data, comparisons and the repository's paths),
`guide_models` (models written as the Keras guides write them),
`stock_fit` (stock Keras under MirroredStrategy, run in its own process) and
`workers/` (the scripts that multi-worker and launcher tests start).
"""
