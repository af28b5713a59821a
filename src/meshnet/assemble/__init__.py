"""The composition roots: what `meshnet node` and `meshnet tracker` assemble from the roles.

Only the CLI imports this package; it imports the roles (`node`, `entry`, `tracker`, `api`).
"""
