"""Unit constants, the one home for them: binary byte multiples and seconds per hour and day.

    from rackcast.units import GIB
    print(f"{n_bytes / GIB:.1f} GiB")
"""

KIB = 2**10  # bytes
MIB = 2**20
GIB = 2**30
SECONDS_PER_HOUR = 3600.0
SECONDS_PER_DAY = 86400.0
US_PER_S = 1e6  # microseconds per second (Chrome trace-event times)
