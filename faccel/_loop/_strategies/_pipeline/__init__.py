"""Pipeline stages' room: the schedule, the stages and their step (``_stages``)."""
