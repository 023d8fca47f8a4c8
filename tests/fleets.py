"""The test session's one `FleetPool`: consecutive runs of one shape in the modules that ask for the `fleets` fixture
share their actor processes (each run re-initialises them). tests/conftest.py clears it before every other test, so
those find the cluster's resources free, and at the end of the session."""

from cluster.fleet.placement import FleetPool

POOL = FleetPool()
