"""`python -m tether_fake_engine`: the same as the `tether-fake-engine` command."""

from . import main

main()
