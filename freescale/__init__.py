"""freescale."""
