"""Pipeline stages' room: their loop strategy (``_strategy``), the schedule and the stages (``_stages``)."""
