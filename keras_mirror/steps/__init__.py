"""Train, test and predict steps: the shared shard arithmetic and one
module per execution path."""
