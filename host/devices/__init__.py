"""Reaching phones: finding them (mDNS, adb), why a found phone is not used, adb and its port wiring."""
