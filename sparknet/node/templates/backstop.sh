#!/bin/sh
exec shutdown -P +$minutes $why
