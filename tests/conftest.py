"""Suite-wide settings."""

import logging

# torch's structured-trace logger records at DEBUG on every compile; a failing test's captured log
# would otherwise be thousands of lines of it, hiding the failure.
logging.getLogger("torch.__trace").propagate = False
