"""The dashboard: a run's topology, metrics, phases and samples, recorded in SQLite and served as a web page.

``plugin.py`` records the dashboard hooks into ``store.py``'s database in the run directory; ``api.py`` answers the
JSON API from it; ``server.py`` serves the API and the page in ``static/`` (no CDN, no build step), to the
``Host`` names that ``hosts.py`` allows.
"""

from miles_core.builtin.dashboard.store import DB_NAME, DashboardDatabaseError, DashboardStore, check_run_dir

__all__ = ["DB_NAME", "DashboardDatabaseError", "DashboardStore", "check_run_dir"]
