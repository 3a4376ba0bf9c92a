"""Elastic replicas (issue 10, first slice): per-outer-step quorum of live replicas on torchft.

See docs/ELASTIC.md. ``ElasticOuterGroup`` averages one flat buffer over the replicas alive at
each outer step; torchft is imported lazily, so this package imports without it.
"""

from dilocox.elastic.group import ElasticBehindError as ElasticBehindError
from dilocox.elastic.group import ElasticConfig as ElasticConfig
from dilocox.elastic.group import ElasticError as ElasticError
from dilocox.elastic.group import ElasticMinReplicasError as ElasticMinReplicasError
from dilocox.elastic.group import ElasticOuterGroup as ElasticOuterGroup
from dilocox.elastic.group import ElasticResult as ElasticResult
from dilocox.elastic.group import ElasticStepError as ElasticStepError
from dilocox.elastic.lighthouse import start_lighthouse as start_lighthouse
