"""The commands: `hybridpar plan | simulate | profile | train | codecs | calibrate`."""
