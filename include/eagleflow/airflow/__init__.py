"""The only code that imports Airflow: operators, sensors, triggers, notifiers."""
