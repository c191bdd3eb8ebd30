"""The planner: search parallel layouts (planner.search) and model sizes (planner.size) against a token budget and a
deadline, explain the choice (planner.explain) and write tables, Parquet and plan files (planner.report).

    rackcast plan --model marin-535b-a23b --topology gb200-nvl72 --racks 11 --tokens 18e12
    rackcast size --family marin-moe --topology gb200-nvl72 --racks 11 --tokens 18e12
"""
