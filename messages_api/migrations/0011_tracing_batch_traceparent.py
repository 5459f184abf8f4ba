from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('messages_api', '0010_tracing_trace_id'),
    ]

    operations = [
        migrations.AddField(
            model_name='messagebatch',
            name='traceparent',
            field=models.CharField(blank=True, db_default='', default='', max_length=55),
        ),
    ]
