"""Generated, offline detection data (COCO format): see :mod:`latte_plugin.data.synthetic`."""
